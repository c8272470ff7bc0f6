// The live VMM workspaces of this process (vmm.cpp), for the launch
// configuration in register.cpp: a VMM workspace holds one rank per process,
// a plain tensor every simulated rank.
#pragma once

namespace moe_a2a {

// True while `base` is the first byte of a workspace that vmm_map mapped and
// whose storage is still alive (thread-safe).
bool is_vmm_workspace(const void* base);

}  // namespace moe_a2a
