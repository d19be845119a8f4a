#!/usr/bin/env bash
# xroute's main job on the embedded defaults (shipped telemetry, local Ray, MLflow in runs/mlflow.db):
#   1. set up .venv            2. train the learned router in parallel Ray Tune trials on three shipped
#      bundles, select on one it never trained on, judge it on test windows no selection saw (the gate)
#   3. promote it to champion only if it passed the gate (else the champion stays; greedy serves)
#   4. compare it with every baseline and the hindsight oracle on the held-out test window
#   5. start the router on the champion and route one request
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
X=.venv/bin/xroute

echo "== 1/4 xroute train"
$X train
echo "== 2/4 xroute promote"
MODEL=models:/xroute-router@champion
if ! $X promote; then
  echo "(the champion alias stays where it was; evaluating the challenger)"
  MODEL=models:/xroute-router@challenger
fi
echo "== 3/4 xroute evaluate on the held-out test window"
$X evaluate --window test --policy "$MODEL" \
  --policy static --policy cheapest --policy lowest-latency --policy least-loaded \
  --policy greedy --policy budget-pacing --policy cache-aware --policy session-sticky \
  --policy round-robin --policy random --policy oracle \
  --output reports/evaluate.json --plot reports/evaluate.png
echo "== 4/4 xroute serve: one routed request"
bash scripts/serve_demo.sh
echo "MLflow UI: .venv/bin/mlflow ui --backend-store-uri sqlite:///$PWD/runs/mlflow.db --host 127.0.0.1"
