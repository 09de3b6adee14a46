// The token masks of the emulator's mask cases: none given, or some (every
// third token and every fifth from 4), every or no token padding. Valid tokens
// get different nonzero bytes, since any nonzero byte means "valid".
#pragma once
#include <cstdint>
#include <vector>

namespace emu {

enum class padding { unmasked, some, all, none };

// Empty for padding::unmasked (no mask).
inline std::vector<std::uint8_t> make_mask(std::int64_t N, padding kind) {
  if (kind == padding::unmasked) return {};
  std::vector<std::uint8_t> mask(N);
  for (std::int64_t t = 0; t < N; ++t) {
    const bool pad = kind == padding::all || (kind == padding::some && (t % 3 == 1 || t % 5 == 4));
    mask[t] = pad ? 0 : static_cast<std::uint8_t>(1 + (t * 37) % 255);
  }
  return mask;
}

}  // namespace emu
