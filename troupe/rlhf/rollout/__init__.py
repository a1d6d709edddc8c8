"""Generation for step 3, on whichever actor holds it: ``engine.RolloutEngine`` (the policy's
inference layout, single- or multi-turn) and ``engine.RolloutReplica`` (an engine on a rollout
actor of its own, fed weights by the policy)."""
