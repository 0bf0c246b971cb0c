#!/usr/bin/env bash
# libFuzzer runs over r3's parsers of outside bytes, with ASan and UBSan. Two targets:
#   request     the /v1/completions and /generate bodies and `r3 generate` JSONL lines
#               (fuzz/request_target.h)
#   checkpoint  the safetensors reader and the config.json parser (fuzz/checkpoint_target.h)
#   template    the chat-template parser and renderer under their budgets (fuzz/jinja_fuzz.cc)
#
#   scripts/fuzz.sh [request|checkpoint|template] [SECONDS] [extra libFuzzer flags...]
#   (target defaults to request, SECONDS to 60)
#
# Builds build-fuzz/<target>_fuzz with Debian's clang++ (only the parser sources, compiled
# directly: no cpp-httplib, no CMake), then fuzzes for SECONDS starting from the seeds in
# fuzz/corpus/ (request) or fuzz/corpus-checkpoint/ (checkpoint). New inputs go to
# build-fuzz/corpus-<target>/ (kept between runs), findings to build-fuzz/artifacts/; the exit
# status is non-zero when libFuzzer found something. Reproduce one with:
# build-fuzz/<target>_fuzz build-fuzz/artifacts/crash-...
# Longer runs: see "Fuzzing" in src/server/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=request
case "${1:-}" in request|checkpoint|template) TARGET=$1; shift ;; esac
SECS=${1:-60}
[ $# -gt 0 ] && shift
CXX=${FUZZ_CXX:-clang++}
OUT=build-fuzz
if [ "$TARGET" = request ]; then
  BIN=$OUT/request_parser_fuzz
  SRCS=(fuzz/request_parser_fuzz.cc fuzz/request_target.cc src/server/json_fields.cc
        src/server/openai_api.cc src/server/generate_api.cc src/engine/request_json.cc
        src/routes/route_array.cc src/core/json_limits.cc src/server/route_reply.cc src/routes/route_formats.cc
        src/routes/route_envelope.cc src/server/chat_api.cc src/text/tokenizer.cc src/text/bpe.cc
        src/text/normalizer.cc src/text/pre_tokenizer.cc src/text/decoder.cc src/text/regex.cc src/text/utf8.cc
        src/text/detokenizer.cc src/text/chat_template.cc src/text/jinja_lexer.cc src/text/jinja_parser.cc src/text/jinja_render.cc src/text/jinja_value.cc
        src/text/jinja_budget.cc src/core/file_read.cc src/core/cancellation.cc)
  SEEDS=fuzz/corpus
  MAXLEN=4096
elif [ "$TARGET" = template ]; then
  BIN=$OUT/jinja_fuzz
  SRCS=(fuzz/jinja_fuzz.cc src/text/jinja_lexer.cc src/text/jinja_parser.cc src/text/jinja_render.cc src/text/jinja_value.cc src/text/jinja_budget.cc src/text/utf8.cc)
  SEEDS=fuzz/corpus-template
  MAXLEN=16384
else
  BIN=$OUT/checkpoint_fuzz
  SRCS=(fuzz/checkpoint_fuzz.cc fuzz/checkpoint_target.cc src/model/safetensors.cc src/core/tensor_view.cc src/core/panel_layout.cc
        src/model/config.cc src/core/file_read.cc src/core/json_limits.cc)
  SEEDS=fuzz/corpus-checkpoint
  MAXLEN=8192
fi
LIBS=()
[ "$TARGET" = template ] && LIBS=(-lutf8proc)
[ "$TARGET" = request ] && LIBS=(-lpcre2-8 -lutf8proc)
FLAGS=(-std=c++20 -O1 -g -fno-omit-frame-pointer -Isrc -I.
       "-fsanitize=fuzzer,address,undefined" -fno-sanitize-recover=undefined)

command -v "$CXX" >/dev/null || { echo "fuzz.sh: $CXX not found (apt-get install clang)" >&2; exit 2; }
mkdir -p "$OUT/obj" "$OUT/corpus-$TARGET" "$OUT/artifacts"

# Rebuild an object when it is missing or older than its source or any header it included.
stale() {
  local o=$1 d=$2 dep
  [ -f "$o" ] && [ -f "$d" ] || return 0
  # Make's dependency list: words after the colon, lines continued with a backslash.
  # shellcheck disable=SC2013
  for dep in $(sed -e 's/^[^:]*://' -e 's/\\$//' "$d"); do
    [ "$dep" -nt "$o" ] && return 0
  done
  return 1
}
objs=()
relink=0
for s in "${SRCS[@]}"; do
  o=$OUT/obj/$(echo "$s" | tr / _).o
  objs+=("$o")
  if stale "$o" "${o%.o}.d"; then
    echo "fuzz.sh: compiling $s"
    "$CXX" "${FLAGS[@]}" -MMD -MF "${o%.o}.d" -c "$s" -o "$o"
    relink=1
  fi
done
if [ $relink = 1 ] || [ ! -x "$BIN" ]; then
  echo "fuzz.sh: linking $BIN"
  "$CXX" "${FLAGS[@]}" "${objs[@]}" -o "$BIN" "${LIBS[@]}"
fi

# Tokens the mutator may splice in: the parsers' field names and JSON edge cases.
cat > "$OUT/request.dict" <<'DICT'
"\"prompt\""
"\"input_ids\""
"\"prompt_token_ids\""
"\"sampling_params\""
"\"max_tokens\""
"\"max_new_tokens\""
"\"temperature\""
"\"top_p\""
"\"top_k\""
"\"seed\""
"\"sampling_seed\""
"\"stop\""
"\"stop_token_ids\""
"\"ignore_eos\""
"\"logprobs\""
"\"return_logprob\""
"\"return_token_ids\""
"\"return_routed_experts\""
"\"routed_experts_start\""
"\"request_id\""
"\"rid\""
"\"n\""
"\"best_of\""
"\"stream\""
"\"echo\""
"\"suffix\""
"\"logit_bias\""
"\"presence_penalty\""
"\"frequency_penalty\""
"\"repetition_penalty\""
"\"min_new_tokens\""
"\"regex\""
"\"text\""
"\"messages\""
"\"role\""
"\"content\""
"\"tools\""
"\"chat_template\""
"\"chat_template_kwargs\""
"\"add_generation_prompt\""
"\"continue_final_message\""
"{% for"
"{{"
"}}"
"| tojson"
"true"
"false"
"null"
"[]"
"{}"
"[[1],[2]]"
"-1"
"2147483648"
"-2147483649"
"9223372036854775807"
"9223372036854775808"
"18446744073709551615"
"18446744073709551616"
"1e308"
"1e309"
"-0"
"0.5"
"\"\\u0000\""
"\"\\ud800\""
"\"\\u00e9\""
DICT

export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
echo "fuzz.sh: fuzzing $TARGET for ${SECS}s"
DICT=()
[ "$TARGET" = request ] && DICT=(-dict="$OUT/request.dict")
exec "$BIN" -max_total_time="$SECS" -max_len=$MAXLEN -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
  "${DICT[@]}" -artifact_prefix="$OUT/artifacts/$TARGET-" "$@" "$OUT/corpus-$TARGET" "$SEEDS"
