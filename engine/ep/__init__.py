"""Expert parallelism: the routed experts of a MoE model spread over a group of ranks.

- ``eplb``: the load balancer, a pure function from per-expert loads to a placement.
"""
