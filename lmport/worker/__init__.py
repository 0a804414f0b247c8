"""One step's device work: the model runner, sampling, pooling and prompt scoring."""
