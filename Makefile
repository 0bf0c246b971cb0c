# Entry points. `make test` is what CI runs (via .ci/run).
BUILD ?= build
JOBS ?= 2

.PHONY: setup configure build test lint unit variants pytest tokenizers e2e pip-install demo bench format clean asan tsan

setup:
	@scripts/setup.sh

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DR3_WARNINGS_AS_ERRORS=ON

configure: $(BUILD)/build.ninja

build: setup configure
	cmake --build $(BUILD) -j $(JOBS)

# Everything: GoogleTest, its kernel and engine-bitwise tests again under each other kernel set, the Python
# module's pytest suite, the tokenizer against the released tokenizers and a JavaScript encoder,
# and the official openai npm client against `r3 serve`.
test: lint unit variants pytest tokenizers e2e pip-install

# Static checks, no build needed: every C++ source as `make format` leaves it (Debian 12's
# clang-format 14, .clang-format), Python (pyflakes3) over python/, tests/ and scripts/, and shell
# scripts (shellcheck). Compiler warnings are errors in the build `make` configures
# (R3_WARNINGS_AS_ERRORS, CMakeLists.txt).
CXX_SOURCES = $$(git ls-files '*.cc' '*.h')
lint: setup
	clang-format --dry-run --Werror $(CXX_SOURCES)
	pyflakes3 python tests setup.py scripts
	shellcheck .ci/run scripts/*.sh

unit: build
	$(BUILD)/r3_tests --gtest_brief=1

# The kernels are compiled for every instruction set and chosen at run time (src/kernels/isa.h);
# `unit` already compares every set this CPU runs with the portable one, kernel by kernel
# (tests/kernel_set_test.cc) and for the whole engine (tests/kernel_set_engine_test.cc). Here the
# kernel, tile and engine-bitwise tests (batch invariance, schedules, routes) run again with each
# other set active (R3_KERNELS); the rest of the suite computes nothing a set changes. First, no
# set's code may leak into symbols baseline code links to (scripts/check_kernel_isolation.py).
# The portable set is 4-10x slower than the vector ones: it leaves out the engine fuzz (hundreds
# of requests per family, 43 s there; its schedules are the engine's, run under every vector
# set) and the attention loop's timing (15 s there; it times, it checks no bits).
VARIANT_TESTS ?= KernelSet.*:*EngineSpeculative*:Matmul*:Attention*:LatentAttention*:SlidingWindow*:Ops*:Router*:Mxfp4*:Fp8*:DType*:Sampling*:Scoring*:*EngineSchedule*:*EngineFuzz*:EngineRoutes*:*SteadyState*:EngineKvCache*:EngineRefit*:Reference/ReferenceVsNaive*
PORTABLE_LEAVES_OUT ?= *EngineFuzz*:AttentionChoice.ForcedCachedOrTimedOnce
VARIANT_RUN = $(BUILD)/r3_tests --gtest_brief=1 --gtest_filter='$(VARIANT_TESTS)'
variants: build
	/usr/bin/python3 scripts/check_kernel_isolation.py $(BUILD)
	R3_KERNELS=portable $(BUILD)/r3_tests --gtest_brief=1 \
	  --gtest_filter='$(VARIANT_TESTS)-$(PORTABLE_LEAVES_OUT)'
	@if grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then \
	  echo "variants: R3_KERNELS=avx2" && R3_KERNELS=avx2 $(VARIANT_RUN); \
	else echo "variants: no AVX2+FMA on this CPU, avx2 skipped"; fi
	@if grep -qw avx512_bf16 /proc/cpuinfo && grep -qw avx512f /proc/cpuinfo && grep -qw avx512bw /proc/cpuinfo && \
	   grep -qw avx512vl /proc/cpuinfo && grep -qw avx512dq /proc/cpuinfo; then \
	  echo "variants: R3_KERNELS=avx512 (AVX-512 without its bf16 instructions)" && \
	  R3_KERNELS=avx512 $(VARIANT_RUN); \
	else echo "variants: no AVX512-BF16 here, so avx512 was the set unit ran (or is unsupported)"; fi

pytest: build
	R3_BUILD=$(BUILD) /usr/bin/python3 -m pytest -q tests/python

e2e: build
	scripts/e2e_openai.sh $(BUILD)

tokenizers: build
	scripts/tokenizer_oracle.sh $(BUILD)

# `pip install .` into a fresh venv (reusing $(BUILD)), then import r3 and run `r3` from it.
pip-install: build
	scripts/pip_install_test.sh $(BUILD)

demo: build
	scripts/demo.sh $(BUILD)

bench: build
	scripts/bench.sh $(BUILD)

# Sanitizers, by hand (too slow for `make test` on 2 cores): the whole GoogleTest suite under
# AddressSanitizer + UndefinedBehaviorSanitizer, and the engine, server and route tests under
# ThreadSanitizer. Any report fails the run.
asan: setup
	cmake -S . -B $(BUILD)-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DR3_PYTHON=OFF \
	  -DCMAKE_CXX_FLAGS="-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined"
	cmake --build $(BUILD)-asan -j $(JOBS) --target r3_tests
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 $(BUILD)-asan/r3_tests --gtest_brief=1

TSAN_TESTS ?= *Engine*:*Server*:FailClosed*:Smoke*
tsan: setup
	cmake -S . -B $(BUILD)-tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DR3_PYTHON=OFF \
	  -DCMAKE_CXX_FLAGS="-O1 -g -fno-omit-frame-pointer -fsanitize=thread"
	cmake --build $(BUILD)-tsan -j $(JOBS) --target r3_tests
	TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 $(BUILD)-tsan/r3_tests --gtest_brief=1 --gtest_filter='$(TSAN_TESTS)'

format:
	clang-format -i $(CXX_SOURCES)

clean:
	rm -rf $(BUILD) $(BUILD)-asan $(BUILD)-tsan
