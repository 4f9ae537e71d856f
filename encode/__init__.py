"""The encode pool: images through a model's vision tower on workers of their own.

``inputs`` turns a chat request's image parts into checked images (the frontend's side:
data URLs, allowed http(s) fetches, the limits); ``worker`` is the encode role of the
worker shell (``python -m encode.worker``): it decodes, preprocesses and encodes images,
keeps their embeddings by content hash (``cache``: memory, then the file tier) and
writes them into the prefill worker's inbox through the KV transport; ``messages`` is
its channel.
"""
