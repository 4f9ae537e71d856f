"""Where requests run: worker processes and their health, routing policies and the prefix index, the frontend's
handle on the prefill and decode pools (``router.disagg.DisaggClient``)."""
