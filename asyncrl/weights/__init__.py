"""The transport of weights from the trainer to the rollout workers; it imports nothing of
asyncrl outside itself.

`broadcast.py` is the collective group of trainer rank 0 and the generators (NCCL or gloo);
`fingerprint.py` what each side hashes of the weights it holds; `size.py` the bytes of an export.
The sync that drives a transport under the rollout gate is the controller's
(control/weight_sync.py); the payloads that reference weights in Ray's object store live in
`runtime/payloads.py`, the vLLM server's receiving side in `generation/vllm_server.py`.
"""
