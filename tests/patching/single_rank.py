"""One-process torch.distributed set-up for the worker scripts in this folder (each runs as
`python <script>`, so this folder is on its sys.path): rank 0 of 1, on a free port unless the test
passes PROBE_PORT (fixed ports collided between two test runs on one machine)."""
import os


def probe_port() -> str:
    """PROBE_PORT if the test passes one, else a free port."""
    port = os.environ.get("PROBE_PORT")
    if not port:
        from megatron_adapt.apps.ports import free_port

        port = str(free_port())
    return port


def one_rank_env() -> None:
    port = probe_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
