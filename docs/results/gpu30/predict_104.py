"""The simulator's prediction for runs 104-106 (thirtieth session): the shipped file
``3ff099d0`` served with **no profile** on the fitted dense server at acceptance 3.0, 8 and
12 requests/s, against static 0 (the plugin's off, the simulator's "no speculation") and
static 3, on the H200 headline replay (``docs/results/gpu26/predict.py``'s cells, this
file's rates).

    PYTHONPATH=$PWD:$PWD/scripts/h200:$PWD/docs/results/offceil24:$PWD/docs/results/gpu26 \\
        python docs/results/gpu30/predict_104.py [seeds]
"""

from __future__ import annotations

import predict

#: (model, acceptance, requests/s, policies): the cells served on the GPU
CELLS = (("dense", 3.0, 8.0, ("static_0", "static_3", "ppo")),
         ("dense", 3.0, 12.0, ("static_0", "static_3", "ppo")))

if __name__ == "__main__":
    predict.main(CELLS)
