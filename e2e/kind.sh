#!/usr/bin/env bash
# End-to-end test of kubellm on a local kind cluster; `make e2e` runs it, and so does .github/workflows/e2e.yaml.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: e2e/kind.sh [--keep-cluster] [--skip-build] [--help] [-- PYTEST_ARGS...]

Runs kubellm end to end on a kind cluster:
  1. creates the kind cluster $KIND_CLUSTER_NAME (default kubellm-e2e), or reuses it if it exists;
  2. builds the runtime-cpu (with the demo model baked in) and operator images with docker and loads them
     into the cluster with `kind load docker-image`;
  3. installs kube-prometheus-stack (a small Prometheus, e2e/values/kube-prometheus-stack.yaml) and
     prometheus-adapter (charts/kubellm/files/prometheus-adapter-values.yaml) in namespace monitoring, and
     the LeaderWorkerSet controller (release LWS_VERSION, namespace lws-system) for multi-node LLMDeployments,
     the Gateway API Inference Extension's CRDs (release GAIE_VERSION) for InferencePools, and KEDA
     (KEDA_VERSION, namespace keda) for scale from zero;
  4. installs the chart charts/kubellm (release kubellm, namespace kubellm-system) with the operator image
     just built and its activator;
  5. runs `pytest e2e/` against the cluster (PYTEST_ARGS are passed on).
On failure the cluster's state and logs are written to $KUBELLM_E2E_ARTIFACTS (default e2e/artifacts).
A cluster this script created is deleted at the end unless --keep-cluster (or KEEP_CLUSTER=1); a reused
one is always kept.

Needs: docker (a running daemon), kind, kubectl, helm, network access to PyPI and the chart and image
registries, and the project's virtual environment (`make test` or `make e2e` creates .venv).

Environment:
  KIND_CLUSTER_NAME        cluster name (default kubellm-e2e)
  KIND_NODE_IMAGE          kindest/node image for a new cluster (default: kind's own; Kubernetes >= 1.30 needed)
  KUBELLM_E2E_TAG          tag of the images built here (default e2e)
  KUBELLM_E2E_ARTIFACTS    folder for logs and dumps (default e2e/artifacts)
  KUBE_PROMETHEUS_STACK_VERSION, PROMETHEUS_ADAPTER_VERSION   chart versions (pinned defaults below)
  LWS_VERSION              LeaderWorkerSet release (default v0.10.0, whose CRD tests/operator/data vendors)
  GAIE_VERSION             Gateway API Inference Extension release (default v1.6.0, whose InferencePool CRD
                           tests/operator/data vendors)
  KEDA_VERSION             KEDA chart version (default 2.21.1): scale from zero
  PYTEST                   pytest to run (default .venv/bin/pytest)
  KEEP_CLUSTER=1, SKIP_BUILD=1   same as the flags
EOF
}

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLUSTER="${KIND_CLUSTER_NAME:-kubellm-e2e}"
CONTEXT="kind-${CLUSTER}"
TAG="${KUBELLM_E2E_TAG:-e2e}"
RUNTIME_IMAGE="kubellm/runtime-cpu:${TAG}"
OPERATOR_REPOSITORY="kubellm/operator"
OPERATOR_IMAGE="${OPERATOR_REPOSITORY}:${TAG}"
ARTIFACTS="${KUBELLM_E2E_ARTIFACTS:-${ROOT}/e2e/artifacts}"
PYTEST="${PYTEST:-${ROOT}/.venv/bin/pytest}"
KEEP_CLUSTER="${KEEP_CLUSTER:-0}"
SKIP_BUILD="${SKIP_BUILD:-0}"
KUBE_PROMETHEUS_STACK_VERSION="${KUBE_PROMETHEUS_STACK_VERSION:-92.1.0}"
PROMETHEUS_ADAPTER_VERSION="${PROMETHEUS_ADAPTER_VERSION:-5.3.0}"
LWS_VERSION="${LWS_VERSION:-v0.10.0}"
GAIE_VERSION="${GAIE_VERSION:-v1.6.0}"
KEDA_VERSION="${KEDA_VERSION:-2.21.1}"
MONITORING_NS=monitoring
OPERATOR_NS=kubellm-system
ADAPTER_VALUES="${ROOT}/charts/kubellm/files/prometheus-adapter-values.yaml"
PYTEST_ARGS=()

while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --keep-cluster) KEEP_CLUSTER=1 ;;
        --skip-build) SKIP_BUILD=1 ;;
        --) shift; PYTEST_ARGS=("$@"); break ;;
        *) echo "kind.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done

log() { printf '\n==> %s\n' "$*" >&2; }
die() { printf 'kind.sh: %s\n' "$*" >&2; exit 1; }

for tool in docker kind kubectl helm; do
    command -v "$tool" >/dev/null || die "$tool is not installed (needed: docker, kind, kubectl, helm)"
done
docker info >/dev/null 2>&1 || die "the Docker daemon is not reachable (docker info failed)"
[[ -x "$PYTEST" ]] || die "$PYTEST not found: create the virtual environment first (make e2e does)"
[[ -f "$ADAPTER_VALUES" ]] || die "$ADAPTER_VALUES is missing (the kubellm chart ships it)"

kc() { kubectl --context "$CONTEXT" "$@"; }

CREATED=0
collect_artifacts() {
    log "collecting cluster state into $ARTIFACTS"
    mkdir -p "$ARTIFACTS"
    kc get nodes,pods -A -o wide >"$ARTIFACTS/pods.txt" 2>&1 || true
    kc get llmd -A -o yaml >"$ARTIFACTS/llmdeployments.yaml" 2>&1 || true
    kc describe llmd -A >"$ARTIFACTS/llmdeployments-describe.txt" 2>&1 || true
    kc get events -A --sort-by .lastTimestamp >"$ARTIFACTS/events.txt" 2>&1 || true
    kc get hpa -A -o yaml >"$ARTIFACTS/hpa.yaml" 2>&1 || true
    kc get leaderworkersets -A -o yaml >"$ARTIFACTS/leaderworkersets.yaml" 2>&1 || true
    kc get inferencepools -A -o yaml >"$ARTIFACTS/inferencepools.yaml" 2>&1 || true
    kc get scaledobjects,endpointslices -A -o yaml >"$ARTIFACTS/scaledobjects-endpointslices.yaml" 2>&1 || true
    kc get --raw /apis/custom.metrics.k8s.io/v1beta1 >"$ARTIFACTS/custom-metrics.json" 2>&1 || true
    helm --kube-context "$CONTEXT" list -A >"$ARTIFACTS/helm-releases.txt" 2>&1 || true
    local ns pod
    for ns in "$OPERATOR_NS" "$MONITORING_NS" lws-system keda; do
        for pod in $(kc get pods -n "$ns" -o name 2>/dev/null); do
            kc logs -n "$ns" "$pod" --all-containers --prefix --tail=5000 \
                >"$ARTIFACTS/logs-${ns}-${pod#pod/}.txt" 2>&1 || true
        done
    done
    kind export logs "$ARTIFACTS/kind" --name "$CLUSTER" >/dev/null 2>&1 || true
}

finish() {
    local rc=$?
    if [[ $rc -ne 0 ]]; then
        collect_artifacts
        echo "kind.sh: FAILED (exit $rc); logs in $ARTIFACTS" >&2
    fi
    if [[ $CREATED -eq 1 && $KEEP_CLUSTER != 1 ]]; then
        log "deleting kind cluster $CLUSTER"
        kind delete cluster --name "$CLUSTER" || true
    elif kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
        echo "kind.sh: cluster $CLUSTER kept (kubectl --context $CONTEXT ...)" >&2
    fi
    exit "$rc"
}
trap finish EXIT

if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
    log "reusing kind cluster $CLUSTER"
else
    log "creating kind cluster $CLUSTER"
    node_image=()
    [[ -n "${KIND_NODE_IMAGE:-}" ]] && node_image=(--image "$KIND_NODE_IMAGE")
    CREATED=1
    kind create cluster --name "$CLUSTER" ${node_image[@]+"${node_image[@]}"} --wait 180s
fi
kc cluster-info >/dev/null

if [[ $SKIP_BUILD != 1 ]]; then
    log "building $RUNTIME_IMAGE (runtime-cpu, demo model baked in) and $OPERATOR_IMAGE"
    DOCKER_BUILDKIT=1 docker build "$ROOT" --target runtime-cpu --build-arg BAKE_DEMO_MODEL=1 -t "$RUNTIME_IMAGE"
    DOCKER_BUILDKIT=1 docker build "$ROOT" --target operator -t "$OPERATOR_IMAGE"
fi
log "loading the images into $CLUSTER"
kind load docker-image --name "$CLUSTER" "$RUNTIME_IMAGE" "$OPERATOR_IMAGE"

log "installing kube-prometheus-stack $KUBE_PROMETHEUS_STACK_VERSION and prometheus-adapter $PROMETHEUS_ADAPTER_VERSION"
helm repo add prometheus-community https://prometheus-community.github.io/helm-charts --force-update >/dev/null
helm repo update prometheus-community >/dev/null
helm --kube-context "$CONTEXT" upgrade --install kube-prometheus-stack prometheus-community/kube-prometheus-stack \
    --version "$KUBE_PROMETHEUS_STACK_VERSION" --namespace "$MONITORING_NS" --create-namespace \
    --values "$ROOT/e2e/values/kube-prometheus-stack.yaml" --wait --timeout 10m
# The adapter queries the Prometheus above; the rules (kubellm:num_requests_waiting as a pods metric) come
# from the kubellm chart's values file, as a user would install them.
helm --kube-context "$CONTEXT" upgrade --install prometheus-adapter prometheus-community/prometheus-adapter \
    --version "$PROMETHEUS_ADAPTER_VERSION" --namespace "$MONITORING_NS" \
    --values "$ADAPTER_VALUES" \
    --set prometheus.url="http://prometheus-operated.${MONITORING_NS}.svc" --set prometheus.port=9090 \
    --wait --timeout 5m

log "installing the LeaderWorkerSet controller $LWS_VERSION"
kc apply --server-side -f "https://github.com/kubernetes-sigs/lws/releases/download/${LWS_VERSION}/manifests.yaml"
kc wait deploy/lws-controller-manager -n lws-system --for=condition=available --timeout=5m

log "installing the Gateway API Inference Extension CRDs $GAIE_VERSION"
kc apply --server-side -f \
    "https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/${GAIE_VERSION}/manifests.yaml"
kc wait --for=condition=Established crd/inferencepools.inference.networking.k8s.io --timeout=60s

log "installing KEDA $KEDA_VERSION"
helm repo add kedacore https://kedacore.github.io/charts --force-update >/dev/null
helm repo update kedacore >/dev/null
helm --kube-context "$CONTEXT" upgrade --install keda kedacore/keda --version "$KEDA_VERSION" \
    --namespace keda --create-namespace --wait --timeout 5m

# rbac.serviceMonitors: the autoscaled test's LLMDeployment asks for a ServiceMonitor (Prometheus must scrape
# the queue depth the HPA scales on), which the operator may create only with that grant. rbac.leaderWorkerSets:
# the multi-node test's LeaderWorkerSet. rbac.inferencePools: the gateway test's InferencePool. rbac.keda and
# activator.enabled: the scale-from-zero test (its ScaledObject queries the Prometheus above); allNamespaces
# because each test runs in a namespace of its own.
log "installing the kubellm chart with $OPERATOR_IMAGE"
helm --kube-context "$CONTEXT" upgrade --install kubellm "$ROOT/charts/kubellm" \
    --namespace "$OPERATOR_NS" --create-namespace \
    --set operator.image.repository="$OPERATOR_REPOSITORY" \
    --set operator.image.tag="$TAG" \
    --set operator.image.pullPolicy=Never \
    --set metrics.serviceMonitor.enabled=true \
    --set rbac.serviceMonitors=true \
    --set rbac.leaderWorkerSets=true \
    --set rbac.inferencePools=true \
    --set rbac.keda=true \
    --set activator.enabled=true \
    --set activator.allNamespaces=true \
    --set autoscaling.prometheusUrl="http://prometheus-operated.${MONITORING_NS}.svc:9090" \
    --wait --timeout 5m
kc wait --for=condition=Established crd/llmdeployments.kubellm.io --timeout=60s

log "running the end-to-end tests"
mkdir -p "$ARTIFACTS"
cd "$ROOT"
KUBELLM_E2E_CONTEXT="$CONTEXT" \
KUBELLM_E2E_RUNTIME_IMAGE="$RUNTIME_IMAGE" \
KUBELLM_E2E_PULL_POLICY=Never \
KUBELLM_E2E_STRICT=1 \
KUBELLM_E2E_ARTIFACTS="$ARTIFACTS" \
    "$PYTEST" e2e/ -v -p no:cacheprovider ${PYTEST_ARGS[@]+"${PYTEST_ARGS[@]}"}
