"""Multi-turn rollouts: environments and tools in the loop, token in, token out.

`trajectory.Trajectory` assembles a sample from the ids the engine saw and sampled; the
connectors (`openenv`, `verifiers`, `nemogym`) and the bundled tool task (services/tasks/calculator.py)
build on it through the --custom-generate-function-path contract.
"""
