"""The README's "try it on this machine" walkthrough of kv-router in front of vLLM, run as written: the
blocks of its section marked ``<!-- readme-test: real-engines -->``, taken and run by
``tests/test_readme.py``'s own machinery (only ports and paths changed), with the outputs it quotes
checked. It makes the tiny model and starts its own two engines with the README's commands (the lane's
session engines run other flags: a smaller cache, the dev-mode reset), then the direct-mode router, the
bridges and their router, and the requests. It runs before ``test_vllm.py``'s tests (file order), so its
engines are stopped before the lane's start: two more engine starts, about 2 to 3 minutes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.real_engines.engines import vllm_python
from tests.test_readme import README, Walkthrough, readme_blocks

pytestmark = pytest.mark.real_engines

# The README's ports: the router's, its NATS's, and each engine's OpenAI API, events and replay.
PORTS = (8000, 4222, 8100, 8101, 5557, 5558, 5567, 5568)
EVENT_PORTS = (5557, 5567)  # vLLM binds them on every interface (`tcp://*:PORT`)


def test_the_readmes_vllm_walkthrough_works_as_written_on_this_machine(tmp_path: Path) -> None:
    python = vllm_python()
    assert python is not None
    blocks = [block for block in readme_blocks(README.read_text()) if block.real_engines]
    assert blocks, "no README block is marked for the real-engine lane"
    walk = Walkthrough(tmp_path, ports=PORTS, bound_on_all=EVENT_PORTS, wait_for_events=True)
    walk.env["KV_ROUTER_VLLM_VENV"] = str(python.parent.parent)  # .ci/vllm_lane.sh finds the lane's venv
    began = time.monotonic()
    try:
        for block in blocks:
            if block.language == "python":
                walk.run_python(block)
            elif block.language == "bash":
                walk.run_shell(block)
    finally:
        walk.stop_all()
    print(f"\nthe README's vLLM walkthrough: {len(blocks)} blocks in {time.monotonic() - began:.0f} s")
    ran = "\n".join(walk.ran)
    for needed in (
        "VLLM_PY=$(.ci/vllm_lane.sh)",
        "make_model.py /tmp/tiny-llama",
        "--port 8101",
        "--engine 2=tcp://127.0.0.1:5567",
        "x-kv-router-cached-tokens",
        "kv-router bridge --worker-id 2",
        "(Python)",
    ):
        assert needed in ran, needed
    for command, _, log in walk.processes:
        if command.startswith("kv-router"):
            text = log.read_text(errors="replace")
            assert "Traceback" not in text, f"{command}:\n{text[-3000:]}"
