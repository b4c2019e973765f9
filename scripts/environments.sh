# Sourced by the scripts: where each of spbcast's Python environments lives. Each is made from
# scripts/envs/<name>.txt by scripts/setup.sh <name>, only when something that needs it runs.
#   main       PyTorch 2.13.0, the drop-ins' trainers, the benchmarks' peers  ($SPBCAST_VENV)
#   reference  the reference PR's PyTorch 2.9.1                                ($SPBCAST_REFERENCE_VENV)
#   swift      ms-swift and its pins                                          ($SPBCAST_SWIFT_VENV)
#   verl       verl and its pins                                              ($SPBCAST_VERL_VENV)
#   demo       numpy and matplotlib for the demo's plot                      ($SPBCAST_DEMO_VENV)
SPBCAST_ENVIRONMENTS=(main reference swift verl demo)

environment_dir() {
    local root="$HOME/.cache/spbcast"
    case "$1" in
        main) echo "${SPBCAST_VENV:-$root/venv}" ;;
        reference) echo "${SPBCAST_REFERENCE_VENV:-$root/venv-torch2.9}" ;;
        swift) echo "${SPBCAST_SWIFT_VENV:-$root/venv-swift}" ;;
        verl) echo "${SPBCAST_VERL_VENV:-$root/venv-verl}" ;;
        demo) echo "${SPBCAST_DEMO_VENV:-$root/venv-demo}" ;;
        *) echo "unknown environment '$1' (${SPBCAST_ENVIRONMENTS[*]})" >&2; return 2 ;;
    esac
}
