"""The heatmap's rule for naming a rank (web/src/noise.js), run in Node: a rank is named only when it is
late in more columns than noise alone gives. A healthy 4-rank run on this machine showed a rank late in 2
of 100 columns by 4.3% of a step, and the page said it was holding the run up."""

from __future__ import annotations

import json
import math
import shutil
import subprocess

from tests.conftest import require
from tests.web.browser import WEB


def fewest(columns: list[int]) -> list[int]:
    node = shutil.which("node")
    require(node is not None, "node is not installed (Node.js 20: apt-get install nodejs)")
    assert node is not None
    script = (
        "import { fewestLateColumns } from './src/noise.js';"
        f"console.log(JSON.stringify({json.dumps(columns)}.map((n) => fewestLateColumns(n))));"
    )
    done = subprocess.run(
        [node, "--input-type=module", "-e", script], cwd=WEB, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def tail(n: int, k: int, p: float = 0.01) -> float:
    return sum(math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(k, n + 1))


def test_two_stray_columns_of_a_hundred_do_not_name_a_rank_and_a_line_does() -> None:
    k = fewest([100])[0]
    assert k > 2, k  # the healthy run's 2 of 100
    assert k <= 10, k  # a rank late in a tenth of the steps shown is named


def test_the_count_is_the_binomial_tail_bound_at_each_width() -> None:
    widths = [2, 3, 10, 30, 100, 240]
    for n, k in zip(widths, fewest(widths), strict=True):
        assert k >= 2 and tail(n, k) <= 1e-3, (n, k)
        assert k == 2 or tail(n, k - 1) > 1e-3, (n, k)  # and the fewest such
