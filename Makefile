# Entry points. `make test` is what CI runs (via .ci/run).
BUILD ?= build
JOBS ?= 2

.PHONY: setup configure build test unit variants pytest e2e pip-install demo bench format clean asan tsan

setup:
	@scripts/setup.sh

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release

configure: $(BUILD)/build.ninja

build: setup configure
	cmake --build $(BUILD) -j $(JOBS)

# Everything: GoogleTest, the kernel tests again on the AVX2+FMA and portable builds, the Python
# module's pytest suite, and the official openai npm client against `r3 serve`.
test: unit variants pytest e2e pip-install

unit: build
	$(BUILD)/r3_tests --gtest_brief=1

# The kernels' other paths must give the native build's bits: the whole suite again on a
# portable build and an AVX2+FMA build (the latter only where the CPU has AVX2 and FMA).
variants: setup
	cmake -S . -B $(BUILD)-portable -G Ninja -DCMAKE_BUILD_TYPE=Release -DR3_NATIVE=OFF
	cmake --build $(BUILD)-portable -j $(JOBS) --target r3_tests
	$(BUILD)-portable/r3_tests --gtest_brief=1
	@if grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then \
	  cmake -S . -B $(BUILD)-avx2 -G Ninja -DCMAKE_BUILD_TYPE=Release -DR3_NATIVE=OFF -DCMAKE_CXX_FLAGS="-mavx2 -mfma" && \
	  cmake --build $(BUILD)-avx2 -j $(JOBS) --target r3_tests && \
	  $(BUILD)-avx2/r3_tests --gtest_brief=1; \
	else echo "variants: no AVX2+FMA on this CPU, AVX2 build skipped"; fi

pytest: build
	R3_BUILD=$(BUILD) /usr/bin/python3 -m pytest -q tests/python

e2e: build
	scripts/e2e_openai.sh $(BUILD)

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
	clang-format -i $$(git ls-files 'src/*.cc' 'src/*.h' 'tools/*.cc' 'tests/*.cc' 'bench/*.cc')

clean:
	rm -rf $(BUILD) $(BUILD)-portable $(BUILD)-avx2 $(BUILD)-asan $(BUILD)-tsan
