"""The worker: one process per session on the GPU node, owning that session's GPU state.

The session server (sessions.py) accepts a connection, checks the lease token and both protocol
versions, then starts `python -m rgpu.remoting.datapath.worker --fd N` with the connected socket
inherited as fd N and the session's facts in $RGPU_WORKER_SESSION (JSON). The worker opens the
backend (a CUDA context on the slice's GPU, or the emulated device), answers WELCOME (or REFUSE
with the reason), and serves frames until the client says BYE or disconnects. Everything the
session held dies with the process, and a crash ends only this session: the client sees its
connection close and reports that clearly.

Requests are served in order on one thread. Async operations (launches, memsets, host-to-device
copies, event records) get no reply; the first error among them is kept and returned by the
next sync call instead of running that call, so errors surface at the next synchronising call.
"""
