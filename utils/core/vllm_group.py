"""Server mode's weight-update group: the trainer and the server's vLLM workers in one group, whose rank 0 holds its
TCP store. On GPUs it is vLLM's `StatelessProcessGroup` with its NCCL communicator (for `vllm serve`, vLLM's own
trainer side: `vllm_nccl_transfer`); a trainer on the CPU joins a gloo group over a `TCPStore` under the prefix
"client2server", with the same handshake. Also the older `trl vllm-serve` protocol's side of the group inside each
vLLM worker (`WeightSyncWorkerExtension`, which vllm_serve.py's engine loads by name). docs/distributed.md.
"""

from datetime import timedelta

import torch

GROUP_PREFIX = "client2server"
CPU_DEVICE_UUID = "cpu"  # what a CPU trainer sends as client_device_uuid (a GPU sends its CUDA device's UUID)


def torch_dtype(name: str) -> torch.dtype:
    """'torch.bfloat16' (the older protocol) or 'bfloat16' (vLLM's) -> torch.bfloat16."""
    dtype = getattr(torch, str(name).rsplit(".", 1)[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class GlooGroup:
    """The CPU weight-update group: a TCPStore held by rank 0 at host:port, a gloo group under GROUP_PREFIX."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout: float = 300.0):
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        wait = timedelta(seconds=timeout)
        self.store = TCPStore(host, int(port), int(world_size), is_master=rank == 0, timeout=wait)
        self.group = ProcessGroupGloo(PrefixStore(GROUP_PREFIX, self.store), int(rank), int(world_size), wait)

    def broadcast(self, tensor: torch.Tensor, src: int):
        self.group.broadcast(tensor, src).wait()

    def barrier(self):
        self.group.barrier().wait()


class NcclGroup:
    """The GPU weight-update group, built as vLLM's weight-transfer engine and TRL build it: vLLM's
    StatelessProcessGroup (rank 0 holds its store) and PyNcclCommunicator."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        self.group = StatelessProcessGroup.create(host=host, port=int(port), rank=int(rank),
                                                  world_size=int(world_size))
        self.communicator = PyNcclCommunicator(self.group, device=device)

    def broadcast(self, tensor: torch.Tensor, src: int):
        self.communicator.broadcast(tensor, src=src)

    def barrier(self):
        self.group.barrier()


def weight_group(host, port, rank, world_size, device, timeout=300.0):
    """NCCL for CUDA tensors, gloo otherwise."""
    if torch.device(device).type == "cuda":
        return NcclGroup(host, port, rank, world_size, device)
    return GlooGroup(host, port, rank, world_size, timeout)


def vllm_nccl_transfer():
    """The trainer's side of `vllm serve`'s NCCL weight-transfer engine, driven as TRL 1.16's client drives it:
    (open(init_info) -> group, send(weights, group), init_info extras, update_info extras). The trainer is rank 0 and
    streams packed buffers. vLLM >= 0.28 sets packing when the group opens (init_info "packed"); earlier releases, per
    update (update_info "packed")."""
    from importlib.metadata import version

    from packaging.version import Version

    if Version(version("vllm")) >= Version("0.28.0"):
        from vllm.distributed.weight_transfer.nccl_common import trainer_init
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        def send(weights, group):
            packed_nccl_broadcast_producer(iterator=weights, group=group, src=0, post_iter_func=lambda item: item[1])

        return trainer_init, send, {"packed": True}, {}
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

    def send(weights, group):
        NCCLWeightTransferEngine.trainer_send_weights(
            iterator=weights, trainer_args=NCCLTrainerSendWeightsArgs(group=group, packed=True))

    return NCCLWeightTransferEngine.trainer_init, send, {}, {"packed": True}


class WeightSyncWorkerExtension:
    """The older protocol's side of the group inside each vLLM worker (`vllm.LLM(worker_extension_cls=...)`, called
    through `collective_rpc` by vllm_serve.py): init_communicator / update_named_param / close_communicator."""

    communicator = None
    client_rank = None

    def init_communicator(self, host, port, world_size, client_device_uuid):
        from vllm.distributed.parallel_state import get_world_group

        if self.communicator is not None:
            raise RuntimeError("the weight-update group is already open; close it first (/close_communicator/)")
        device = torch.device(self.device)
        if device.type == "cuda" and client_device_uuid == str(torch.cuda.get_device_properties(device).uuid):
            raise RuntimeError(f"the trainer and this vLLM worker share the GPU {client_device_uuid}: give the server "
                               "its own GPUs (CUDA_VISIBLE_DEVICES)")
        # a trainer on the CPU joins over gloo: the weights arrive in host memory and are loaded from there
        self.group_device = torch.device("cpu") if client_device_uuid == CPU_DEVICE_UUID else device
        self.communicator = weight_group(host, port, get_world_group().rank, world_size, self.group_device)
        self.client_rank = int(world_size) - 1

    def update_named_param(self, name, dtype, shape):
        if self.communicator is None:
            raise RuntimeError("no weight-update group: call /init_communicator/ first")
        weight = torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=self.group_device)
        self.communicator.broadcast(weight, src=self.client_rank)
        self.communicator.barrier()
        self.model_runner.model.load_weights(weights=[(name, weight)])

    def close_communicator(self):
        self.communicator = self.client_rank = None
