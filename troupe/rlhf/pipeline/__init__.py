"""What the driver runs over the roles' actors: steps 1 and 2 and evaluation (``stages``), the
step-3 loop of the online algorithms (``step3``) with its batches (``scoring``) and rewards
(``rewards``), DPO (``dpo``), and the rollout replicas as the driver supervises them
(``replicas``)."""
