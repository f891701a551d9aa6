"""port-slime's static bash evaluator (lichen.port_slime.bash_eval via slime_script.read_script), cross-checked against
real bash: each script here only calls `python3 train.py ...`, which the bash run replaces by a function printing
its arguments, so bash runs nothing. The evaluator must give the same argv for the same environment."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from lichen.errors import ConfigError
from lichen.port_slime.bash_values import Assumptions
from lichen.port_slime.script import ScriptNotEvaluated, read_script

BASH = shutil.which("bash")
IF_ELSE = """\
NUM_GPUS=${NUM_GPUS:-8}
if [ "$NUM_GPUS" -ge 8 ]; then
  ENGINES=4   # one engine per 2 GPUs
elif [ "$NUM_GPUS" -eq 4 ]; then
  ENGINES=2
else
  ENGINES=1
fi
python3 train.py --actor-num-gpus-per-node $NUM_GPUS --rollout-num-gpus "$NUM_GPUS" \\
   --rollout-num-engines $ENGINES
"""
ARRAYS = """\
ARR=( --a 1   # a comment inside the list
      "--b c"
      'd e' )
ARR+=( --f "$X" )
EMPTY=()
ARR[6]=last
ARR[1]=one
python3 train.py "${ARR[@]}" ${ARR[@]} "${EMPTY[@]}" ${#ARR[@]} "${ARR[1]}" "x${ARR[@]}y" "${ARR[*]}"
"""
ARITH = """\
N=5
i=0
((i++)); ((i += 10))
let "j = N * 3" k=7%3
for ((s = 0, t = 0; s < N; s++)); do t=$((t + s)); done
python3 train.py $((N * 2 + 1)) $(( (N + 3) / 2 )) $((-7 / 2)) $((-7 % 2)) $i $j $k $t $((N > 3 ? 10 : 20)) \\
   $((2 ** 10)) $((0x10 + 010)) $((N == 5 && i == 11))
"""
DEFAULTS = """\
EMPTY=
python3 train.py "${UNSET_A:-dflt}" "${EMPTY:-dflt2}" "${EMPTY-kept}" "${UNSET_B:=assigned}" "$UNSET_B" \\
   "${NUM:+alt}" "${#NUM}" "${PATHV%.sh}" "${PATHV##*/}" "${PATHV#*/}" "${UNSET_C:-${NUM:-c}}" "${NUM:1:2}" \\
   ${UNSET_D} "${UNSET_E}"
"""
CONDITIONS = """\
R=""
if [[ $NAME == qwen* && -n "$NAME" ]]; then R+=glob; fi
if [[ "$NAME" == "qwen*" ]]; then R+=literal; fi
if [ -z "$EMPTY" ] && [ "$NUM" != 3 ] || false; then R+=,andor; fi
if [ "$EMPTY" -gt 0 ]; then R+=,err; else R+=,interr; fi
if ! [ "$NUM" -lt 10 ]; then R+=,neg; else R+=,lt; fi
if test "$NUM" -ne 12 -a "$NAME" = qwen3; then R+=,test; fi
if [[ $NUM -ge 2*6 ]]; then R+=,arith; fi
if [[ $NAME =~ ^qw(en)[0-9]$ ]]; then R+=,re; fi
python3 train.py "$R"
"""
MISC = """\
export A=1 B="two words"
readonly C=3
declare -a D=(x y)
LONG="line one \\
continued"   # comment
J=$(cat <<EOF
{"k": "${A}", 'q': "$B"}
EOF
)
printf -v P "[%s|%03d]" "$A" 7
OUT=$(IFS=','; ARR=(1 2 3); echo "${ARR[*]}")
D2=$(dirname -- "/a/b/c.sh")
BN=$(basename /a/b/c.sh .sh)
W=""
for x in a b c d; do
  if [ "$x" = b ]; then continue; fi
  if [ "$x" = d ]; then break; fi
  W+=$x
done
n=0
while [ $n -lt 3 ]; do n=$((n + 1)); done
SEQ=$(seq 2 2 8)
true && T=yes || T=no
false && F=yes || F=no
{ G=grouped; }
( H=subshell )
python3 train.py "$A" "$B" $C ${D[@]} "$LONG" "$J" "$P" "$OUT" "$D2" "$BN" "$W" $n $SEQ $T $F $G "${H:-none}" ~/x
"""
CROSS_CHECK = {
    "if_else_env_4": (IF_ELSE, {"NUM_GPUS": "4"}),
    "if_else_default": (IF_ELSE, {}),
    "if_else_env_1": (IF_ELSE, {"NUM_GPUS": "1"}),
    "arrays": (ARRAYS, {"X": "with space"}),
    "arith": (ARITH, {}),
    "defaults": (DEFAULTS, {"NUM": "12", "PATHV": "dir/sub/run.sh"}),
    "conditions": (CONDITIONS, {"NUM": "12", "NAME": "qwen3", "EMPTY": ""}),
    "misc": (MISC, {"HOME": "/home/u"}),
}


def _bash_argv(script: Path, env: dict[str, str]) -> list[str]:
    """What bash passes to train.py: python3 is a function that prints its arguments, NUL-separated."""
    runner = 'python3() { shift; printf "%s\\0" "$@"; exit 0; }; source "$1"'
    result = subprocess.run(
        [BASH, "-c", runner, "bash", str(script)],
        env={"PATH": os.environ["PATH"], **env},
        cwd=script.parent,
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.decode().split("\0")[:-1]


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
@pytest.mark.parametrize("case", sorted(CROSS_CHECK))
def test_evaluator_matches_bash(tmp_path, monkeypatch, case):
    text, env = CROSS_CHECK[case]
    script = tmp_path / "run.sh"
    script.write_text(text)
    monkeypatch.chdir(tmp_path)
    expected = _bash_argv(script, env)
    assert read_script(str(script), environ=dict(env)).argv == expected


def test_if_else_takes_the_branch_bash_takes():
    """The issue's case: NUM_GPUS=4 in the environment gives 4 GPUs and 2 engines (both branches were taken)."""
    path = Path(__file__).parent / "_if_else.sh"
    try:
        path.write_text(IF_ELSE)
        argv = read_script(str(path), environ={"NUM_GPUS": "4"}).argv
    finally:
        path.unlink()
    assert argv == ["--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4", "--rollout-num-engines", "2"]


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_source_relative_to_the_script_and_script_dir_idiom(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.sh").write_text("N=2\nMODEL_ARGS=(\n  --num-layers $((N + 1))  # three\n)\n")
    (tmp_path / "models" / "other.sh").write_text("OTHER=from-dot\n")
    script = tmp_path / "run.sh"
    script.write_text(
        'SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"\n'
        'source "${SCRIPT_DIR}/models/m.sh"\n'
        ". models/other.sh\n"
        'python3 train.py ${MODEL_ARGS[@]} --dir "$SCRIPT_DIR" --other $OTHER\n'
    )
    monkeypatch.chdir(tmp_path)
    expected = _bash_argv(script, {})
    assert expected == ["--num-layers", "3", "--dir", str(tmp_path), "--other", "from-dot"]
    assert read_script(str(script), environ={}).argv == expected
    monkeypatch.chdir("/")  # port-slime run from elsewhere: `. models/other.sh` is found next to the script
    assert read_script(str(script), environ={}).argv == expected


UNEVALUABLE = """\
NVLINK_COUNT=$(nvidia-smi topo -m 2>/dev/null | grep -o 'NV[0-9]*' | wc -l)
if [ "$NVLINK_COUNT" -gt 0 ]; then
    HAS_NVLINK=1
else
    HAS_NVLINK=0
fi
echo "HAS_NVLINK: $HAS_NVLINK"
UNUSED=$(hostname)
ray job submit --runtime-env-json="{\\"env_vars\\": {\\"NCCL_NVLS_ENABLE\\": \\"${HAS_NVLINK}\\"}}" \\
   -- python3 train.py --rollout-num-gpus 2
"""


def test_unevaluable_value_stops_and_assume_settles_it(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(UNEVALUABLE)
    with pytest.raises(ScriptNotEvaluated) as e:
        read_script(str(script), environ={})
    [item] = e.value.items  # the unused $(hostname) is not an item: its value does not matter
    message = item.message()
    assert message.startswith(f"{script}:9: ") and "nvidia-smi topo -m" in message and f"{script}:1" in message
    assert "--assume NVLINK_COUNT=VALUE" in message and "--assume HAS_NVLINK=VALUE" in message
    assert read_script(str(script), environ={}, assume=Assumptions.parse(["NVLINK_COUNT=4"])).env_vars == {
        "NCCL_NVLS_ENABLE": "1"
    }
    assert read_script(str(script), environ={}, assume=Assumptions.parse(["HAS_NVLINK=0"])).env_vars == {
        "NCCL_NVLS_ENABLE": "0"
    }


@pytest.mark.parametrize(
    "text, needle, settle",
    [
        (
            "if [ -f /root/ckpt/x ]; then L=a; else L=b; fi\npython3 train.py --load $L\n",
            "file system",
            "-f /root/ckpt/x=true",
        ),
        ('if [ "$MISSING" = 1 ]; then L=a; fi\npython3 train.py --load "$L"\n', "set neither", "MISSING=1"),
        ("for h in $(cat hosts); do L=$h; done\npython3 train.py --load $L\n", "cat hosts", "L=x"),
        ("f() { L=x; }\nf\npython3 train.py --load $L\n", "function f", None),
        ("case $X in a) L=1;; esac\npython3 train.py --load $L\n", "`case`", None),
        ('eval "L=1"\npython3 train.py --load $L\n', "`eval`", None),
        ("if command -v nvidia-smi; then python3 train.py --a; fi\n", "whether the train.py command here runs", None),
        ("if [ -d /data ]; then exit 1; fi\npython3 train.py --a\n", "whether the script exits here", "-d /data=false"),
    ],
)
def test_each_unevaluable_construct_is_an_item_naming_its_line(tmp_path, text, needle, settle):
    script = tmp_path / "run.sh"
    script.write_text(text)
    with pytest.raises(ScriptNotEvaluated) as e:
        read_script(str(script), environ={})
    messages = [item.message() for item in e.value.items]
    assert any(needle in m and m.startswith(f"{script}:") for m in messages), messages
    if settle is not None:
        assert read_script(str(script), environ={}, assume=Assumptions.parse([settle])).entry == "train.py"


def test_exit_before_the_command_is_one_error(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text('MASTER_ADDR=${MASTER_ADDR:-}\nif [ -z "$MASTER_ADDR" ]; then\n  exit 1\nfi\npython3 train.py\n')
    with pytest.raises(ConfigError, match=r"run.sh:3: the script exits here \(exit 1\) before its train.py"):
        read_script(str(script), environ={})
    assert read_script(str(script), environ={"MASTER_ADDR": "10.0.0.1"}).argv == []


def test_assume_rejects_what_it_cannot_read():
    with pytest.raises(ConfigError, match="give NAME=VALUE"):
        Assumptions.parse(["no-equals"])
    with pytest.raises(ConfigError, match="=true or =false"):
        Assumptions.parse(["-f /x=maybe"])


def test_syntax_error_names_the_line(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("A=1\nif [ x ]; then\n  B=2\n")
    with pytest.raises(ConfigError, match=r"run.sh:\d+: "):
        read_script(str(script), environ={})
