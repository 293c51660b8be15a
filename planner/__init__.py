"""Capacity planning: a node's measured costs (``profile``), a discrete-event simulation of a cluster
that routes with the router's own policy and KV index code (``sim``), and the search for the smallest
cluster that meets latency targets on a trace (``plan``)."""
