"""The user's code in processes of its own: ``pool.SandboxProcess`` starts one (its own process
group, an address-space limit, JSON lines both ways) running ``child.py`` by path. Reward
functions (troupe.rlhf.pipeline.rewards) and agent environments (troupe.rlhf.agents) are its
two users; it imports nothing of troupe."""
