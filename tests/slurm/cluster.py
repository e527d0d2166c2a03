"""The Slurm test cluster: the harness lives in the package (the demo uses it too)."""

from rgpu.slurm_plugin.localcluster import (
                                             ClusterConfig,
                                             SlurmCluster,
                                             find_binary,
                                             free_ports,
                                             missing_requirements,
                                             wait_until,
)

__all__ = ["ClusterConfig", "SlurmCluster", "find_binary", "free_ports", "missing_requirements", "wait_until"]
