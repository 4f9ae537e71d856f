"""``ferry bench``: a load generator for any OpenAI-compatible server.

workloads (what to send) → runner (closed/open loop over client streams) → stats
(aggregates) → sweep (points, JSON) → plots (PNG); cli wires them to the command line.
"""
