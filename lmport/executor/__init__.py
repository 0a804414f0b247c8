"""Executors: the model runners in this process, one per rank over torch.distributed, or as Ray actors."""
