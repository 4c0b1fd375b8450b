#!/usr/bin/env bash
# Build tracemagic/views/plotly-report.min.js: plotly.js with only the trace types the views
# draw (scatter, bar, heatmap, icicle, sunburst), inlined in the HTML report instead of the
# full bundle (a fifth of the code to evaluate: the report's first figure paints sooner).
# Same plotly.js version as the installed plotly's (the report falls back to the full bundle
# when they differ, or when a figure has another trace type). Needs node and npm (the npm
# registry); the built file is committed, so users and CI never run this.
#   usage: bash scripts/build_plotly_bundle.sh   (from the repository root)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
VERSION="$("$PY" -c 'from plotly.offline import get_plotlyjs_version as v; print(v())')"
ESBUILD=0.28.2
OUT="$ROOT/tracemagic/views/plotly-report.min.js"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
npm init -y >/dev/null
npm install --no-audit --no-fund --ignore-scripts "plotly.js@$VERSION" "esbuild@$ESBUILD" >/dev/null
cat > entry.js <<'JS'
var Plotly = require('plotly.js/lib/core');  // scatter, and every layout component
Plotly.register([
  require('plotly.js/lib/bar'),
  require('plotly.js/lib/heatmap'),
  require('plotly.js/lib/icicle'),
  require('plotly.js/lib/sunburst'),
]);
module.exports = Plotly;
JS
# the same settings as plotly.js's own dist build (esbuild-config.js); CSS is only maplibre's (map traces)
npx esbuild entry.js --bundle --minify --format=iife --global-name=Plotly --define:global=window \
  --define:define.amd=false --target=es2016 --loader:.css=empty --legal-comments=eof --log-level=warning \
  --outfile=bundle.js
{
  printf '/*! plotly.js v%s (MIT license, Copyright 2012-2026 Plotly, Inc.): a partial bundle of the traces scatter, bar, heatmap, icicle, sunburst, built by tracemagic scripts/build_plotly_bundle.sh with esbuild %s */\n' "$VERSION" "$ESBUILD"
  cat bundle.js
} > "$OUT"
echo "wrote $OUT ($(wc -c < "$OUT") bytes, plotly.js $VERSION)"
