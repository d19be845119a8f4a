#!/usr/bin/env bash
# Start the router on the trained champion (fallback: greedy), route one request, show the answer
# and the decision read back, then stop. Keys, the config and the decision log live under runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
mkdir -p runs/demo
KEYS=runs/demo/keys.json DB=runs/demo/decisions.db
rm -f "$KEYS"
KEY=$(.venv/bin/xroute keys add --tenant demo --keys-file "$KEYS" | tail -n1)   # printed once, stored hashed
printf 'tenants:\n  demo: {}\n' > runs/demo/router.yaml   # the tenants the router serves (others: 403)
PORT=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
.venv/bin/xroute serve --config runs/demo/router.yaml --host 127.0.0.1 --port "$PORT" --keys-file "$KEYS" --db "$DB" \
  > runs/demo/serve.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -fs "http://127.0.0.1:$PORT/readyz" >/dev/null 2>&1 && break
  kill -0 $SERVER 2>/dev/null || { echo "xroute serve exited:"; cat runs/demo/serve.log; exit 1; }
  sleep 0.5
done
echo "== POST /v1/route (router on 127.0.0.1:$PORT)"
ANSWER=$(curl -fsS "http://127.0.0.1:$PORT/v1/route" -H "Authorization: Bearer $KEY" \
  -H 'content-type: application/json' \
  -d '{"origin":"aws:us-east-2","input_tokens":800,"max_output_tokens":200,"ttft_ms":2000,"tpot_ms":100}')
echo "$ANSWER" | $PY -m json.tool
ID=$(echo "$ANSWER" | $PY -c 'import json,sys; print(json.load(sys.stdin)["decision_id"])')
echo "== GET /v1/decisions/$ID (durably recorded before the answer)"
curl -fsS "http://127.0.0.1:$PORT/v1/decisions/$ID" -H "Authorization: Bearer $KEY" \
  | $PY -c 'import json,sys; d=json.load(sys.stdin); print(d["decision_id"], d["created_at"], d["offering"]["offering_id"], "by", d["policy"]["name"])' 
