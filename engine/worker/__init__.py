"""The one worker shell every worker process runs in, whatever its role: its config
(``config``), its channel to the frontends (``channel``), the loop and the role contract
(``shell``), and the frontend's handle on a worker (``handle``)."""
