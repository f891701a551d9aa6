"""The Ray runtime (`--runtime ray`, docs/runtimes.md): placement of trainer ranks and engines on one Ray
placement group, trainer ranks as Ray actors running lichen.train.dist_trainer.DistTrainer, `lichen serve`
engines started by Ray actors on their bundles. The loop drives them through the same calls as the local runtime.
"""
