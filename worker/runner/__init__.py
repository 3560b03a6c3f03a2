"""Running the model: inputs from a SchedulerOutput, the forward (eager, compiled, CUDA graphs), sampling, model set-up."""
