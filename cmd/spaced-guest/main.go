// Command spaced-guest is the SPACE in-sandbox agent (envd-compatible API;
// see package guest). ns mode: JSON of guest.Config in $SPACE_GUEST_CONFIG,
// listener inherited fd 3 or --listen unix:/path | tcp:host:port, user
// cgroup from $SPACE_CGROUP_FD (see internal/guest/cgexec), optional.
// VM mode: $SPACE_GUEST_VM_PORT names the virtio-serial port; the
// configuration arrives in the host's ACTIVATE message (guest.RunVM).
// Either way the configuration's network (guest.NetworkConfig) is applied
// at start and at every activation: resolv.conf, the egress CA and, in a
// VM, the NIC.
// Both variables are unset once read, so children do not inherit them.
package main

import (
	"log"
	"os"

	"github.com/spacesbx/space/internal/guest"
	"github.com/spacesbx/space/internal/guest/cgexec" // also: the wrapper of user commands (its init)
)

func main() {
	cfg, port := os.Getenv("SPACE_GUEST_CONFIG"), os.Getenv("SPACE_GUEST_VM_PORT")
	_ = os.Unsetenv("SPACE_GUEST_CONFIG")
	_ = os.Unsetenv("SPACE_GUEST_VM_PORT")
	userCgroup, err := cgexec.FromEnv()
	if err != nil {
		log.Fatalf("spaced-guest: %v", err)
	}
	os.Exit(guest.Main(guest.MainOptions{
		Args: os.Args[1:], ConfigJSON: cfg, VMPort: port, UserCgroup: userCgroup, Stderr: os.Stderr,
	}))
}
