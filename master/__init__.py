"""kvtier.master: the kvtier-master cluster directory daemon (nodes, placements, heat, cost)."""
