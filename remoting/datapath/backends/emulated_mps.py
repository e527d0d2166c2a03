"""The emulated backend's MPS fault domain: the files it leaves in the GPU's shared folder, which the
dispatcher reads (dispatcher/session_faults.py) as it would read NVIDIA's MPS server log."""

EMULATED_MPS_LOG = "emulated-mps-server.log"   # what the emulated MPS server "logs" (faulting client's pid)
# The emulated backend's MPS fault domain: a marker file in the GPU's shared folder (backends/emulated_device.py).
EMULATED_MPS_FAULT = "emulated-mps-fault"
