"""Where weights move from the trainer to the rollout workers.

`sync.py` decides when (the rollout gate, drain or in-flight sync, timings and bytes);
`broadcast.py` is the collective group of trainer rank 0 and the generators (NCCL or gloo).
Payloads in Ray's object store live in `runtime/ray.py`, the vLLM server's receiving side in
`generation/vllm_server.py`.
"""
