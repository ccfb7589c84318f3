"""Where weights move from the trainer to the rollout workers.

`sync.py` moves them under the controller's rollout gate (control/gate.py): drain or in-flight
sync, timings and bytes; `broadcast.py` is the collective group of trainer rank 0 and the
generators (NCCL or gloo). The payloads that reference weights in Ray's object store live in
`runtime/payloads.py`, the vLLM server's receiving side in `generation/vllm_server.py`.
"""
