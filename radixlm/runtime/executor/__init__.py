"""The model and one forward (scheduler process): model runner, forward batch, models,
sampling. It is handed a ``ModelWorkerBatch`` and never imports the managers."""
