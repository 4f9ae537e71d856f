"""Where requests run: worker processes and their health, P/D pairing, the frontend's
handle on the prefill and decode pools (``router.disagg.DisaggClient``)."""
