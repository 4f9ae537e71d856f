"""Where requests run: worker processes and their health, the prefix index and routing
policies, and the frontend's handle on the prefill and decode pools
(``router.disagg.DisaggClient``)."""
