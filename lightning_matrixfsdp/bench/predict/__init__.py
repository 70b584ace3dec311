"""The step-time predictor (``python -m lightning_matrixfsdp.bench predict``): an analytic model
of each benchmark mode's step time and memory, no GPU and no process group needed.

``modes.py`` the modes, ``shape.py`` the workload, ``comm.py`` the communication, ``tp.py`` the
tensor-parallel modes, ``cluster.py`` the cluster descriptions, ``cli.py`` the command line.
"""
