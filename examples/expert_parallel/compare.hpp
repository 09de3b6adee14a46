// The comparison the test runs: an MPI run of moe_route_ep against the
// single-process reference, field by field (compare.cpp says which fields must
// be bit-equal and which agree to a tolerance, and why).
#pragma once

#include <iosfwd>
#include <string>

#include <nlohmann/json.hpp>

namespace ep {

using json = nlohmann::json;

// Throws std::runtime_error "<name>: not a moe_route_ep record (<what>)"
// unless `record` holds what compare reads: a "layer" object, a "steps" array
// of objects and a "final" object, each compared field a number or an array
// of numbers.
void check_record(const json& record, const std::string& name);

// Compares a run with the reference (both passing check_record): one line per
// field on `report`, then "agree" or "DISAGREE"; true if every field agrees.
bool compare(const json& reference, const json& run, std::ostream& report);

// What --compare does: reads both files, checks them, compares them. Throws
// std::runtime_error naming the file that cannot be read, is not JSON or is
// not a record.
bool compare_files(const std::string& reference, const std::string& run, std::ostream& report);

}  // namespace ep
