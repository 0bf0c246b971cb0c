# Entry points. `make test` is what CI runs (via .ci/run).
BUILD ?= build
JOBS ?= 2

.PHONY: setup configure build test unit variants pytest e2e demo bench format clean

setup:
	@scripts/setup.sh

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release

configure: $(BUILD)/build.ninja

build: setup configure
	cmake --build $(BUILD) -j $(JOBS)

# Everything: GoogleTest, the kernel tests again on the AVX2+FMA and portable builds, the Python
# module's pytest suite, and the official openai npm client against `r3 serve`.
test: unit variants pytest e2e

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

demo: build
	scripts/demo.sh $(BUILD)

bench: build
	scripts/bench.sh $(BUILD)

format:
	clang-format -i $$(git ls-files 'src/*.cc' 'src/*.h' 'tools/*.cc' 'tests/*.cc' 'bench/*.cc')

clean:
	rm -rf $(BUILD) $(BUILD)-portable $(BUILD)-avx2
