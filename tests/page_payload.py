"""The data a report.html carries, decoded, for the tests that read the page."""

import base64
import json
import re

import numpy as np


def page_payload(path):
    """The data report.html carries (its run-data script), attention decoded `[L, N, T, S]`."""
    text = path.read_text()
    found = re.search(r'<script type="application/json" id="run-data">(.*?)</script>', text, re.DOTALL)
    data = json.loads(found.group(1))
    for checkpoint in data["checkpoints"]:
        checkpoint["attention"] = [
            np.frombuffer(base64.b64decode(blob), np.uint8).astype(np.float64) / data["levels"]
            for blob in checkpoint["attention"]
        ]
    for checkpoint in data["checkpoints"]:
        checkpoint["attention"] = [
            weights.reshape(
                len(data["layers"]), data["num_heads"], len(e["query_tokens"]), len(e["key_tokens"])
            )
            for weights, e in zip(checkpoint["attention"], data["examples"], strict=True)
        ]
    return data
