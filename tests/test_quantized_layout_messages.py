"""The first screen of every peftplug command: no error-looking start-up line about bitsandbytes' CPU hub kernel
(which only multiplies repacked 4-bit weights, and peftplug never creates those)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from peftplug.quantized_layout import UNUSED_KERNEL_MESSAGES, hide_unused_kernel_warning


def test_importing_peftplug_then_bitsandbytes_prints_no_kernel_warning():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", "import peftplug, bitsandbytes, peft"], capture_output=True,
                          text=True, env=env, timeout=300, check=True)
    for prefix in UNUSED_KERNEL_MESSAGES.values():
        assert prefix not in proc.stderr + proc.stdout


def test_only_those_messages_are_dropped(caplog):
    hide_unused_kernel_warning()
    hide_unused_kernel_warning()  # idempotent: one filter per logger
    for name, prefix in UNUSED_KERNEL_MESSAGES.items():
        logger = logging.getLogger(name)
        assert len(logger.filters) == 1
        with caplog.at_level(logging.WARNING, logger=name):
            caplog.clear()
            logger.warning(prefix + " from kernels-community: offline")
            logger.warning("something else bitsandbytes says")
        assert [r.getMessage() for r in caplog.records] == ["something else bitsandbytes says"]
