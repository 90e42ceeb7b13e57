"""Read MIG profiles and placements from NVML (READ-ONLY) and compare them with the built-in table.

Run on the GPU machine from the repository root:  python3 -m scripts.gpu.mig_profiles [--device 0]
It prints a JSON report and, when $OUT is set, also writes it to $OUT/mig_profiles.json.
Only read-only NVML calls are made: the MIG mode and layout are never changed.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from services.executor.mig.nvml_profiles import read_profiles_from_nvml
from services.executor.mig.profiles import (
    H200_141GB,
    compare_with_nvml,
    model_for_device_name,
    profile_table,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)

    import pynvml

    nvml_report = read_profiles_from_nvml(pynvml, args.device)
    model = model_for_device_name(nvml_report["device_name"]) or H200_141GB
    differences = compare_with_nvml(model, nvml_report["profiles"])
    report = {
        "compared_with": model.key,
        "agree": not differences,
        "differences": differences,
        "nvml": nvml_report,
        "builtin": profile_table(model),
    }
    text = json.dumps(report, indent=2, sort_keys=True)
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, "mig_profiles.json").write_text(text + "\n")
    return 0 if not differences else 1


if __name__ == "__main__":
    raise SystemExit(main())
