"""Expert parallelism: the routed experts of a MoE model spread over a group of ranks.

- ``eplb``: the load balancer, a pure function from per-expert loads to a placement.
- ``comm``: the group's collectives (torch.distributed: gloo, NCCL; or one rank alone).
- ``dispatcher``: ``MoEDispatcher``, tokens to the ranks holding their experts and back.
- ``experts``: a rank's share of the experts (``ExpertSlots`` in each MoE layer), routing
  over replicas, and rebalancing with weights moving between ranks.
- ``load``: per-layer per-expert token counts (step, sliding window, total) and the
  routing trace file.
- ``group``: a worker as one rank of a group, stepping in lockstep with the others.
- ``role``: what a worker role adds to be such a rank (the prefill and decode roles).
"""
