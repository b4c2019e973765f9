# Sourced by .ci/run and scripts/test.sh: `step TEXT` prints "=== [m:ss] $STEP_LABEL: TEXT", the
# time since the run began (.ci/run's start, which the test.sh it runs inherits).
export SPBCAST_CLOCK_START="${SPBCAST_CLOCK_START:-$(date +%s)}"
step() {
    local s=$(($(date +%s) - SPBCAST_CLOCK_START))
    printf '=== [%d:%02d] %s: %s\n' $((s / 60)) $((s % 60)) "$STEP_LABEL" "$*"
}
