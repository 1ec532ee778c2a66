"""What an analyst's reads load: `trainer-client stats` and `export`, and `TrainerClient` until it makes
tensors, read the store without torch (a gigabyte to install, seconds to import)."""

from __future__ import annotations

import subprocess
import sys

READS = """
import sys
import trainer_client.cli
from trainer_client import SampleOptions, TrainerClient
print(sorted(name for name in ("torch", "transformers") if name in sys.modules))
"""


def test_reading_samples_and_the_cli_load_no_torch():
    loaded = subprocess.run([sys.executable, "-c", READS], check=True, capture_output=True, text=True)

    assert loaded.stdout.strip() == "[]"


def test_a_batch_loads_torch_when_it_makes_tensors():
    code = "import sys; from trainer_client import Batch; print('torch' in sys.modules); Batch([]).packed(); "
    code += "print('torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)

    assert loaded.stdout.split() == ["False", "True"]
