// SPDX-License-Identifier: Apache-2.0
// Must not compile: stria tiles are 64x64.
#include "stria/core/tile.hpp"
int main() { return stria::tile<32, 64, 128>::block_q; }
