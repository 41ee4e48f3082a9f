package volume

import (
	"errors"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/errdefs"
)

func TestValidatePathRejects(t *testing.T) {
	for _, p := range []string{
		"", "/", "relative", "mnt/data", "/mnt/../etc", "/mnt/./data", "/mnt//data", "/mnt/data/",
		"/proc", "/proc/self", "/sys", "/sys/fs/cgroup", "/dev", "/dev/shm", "/.space", "/.space/spaced-guest",
		"/mnt/\x00x", "/mnt/a\nb", "/mnt/a\\b", "/" + strings.Repeat("a", MaxPathLen),
	} {
		if err := ValidatePath(p); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("ValidatePath(%q) = %v, want invalid", p, err)
		}
	}
	for _, p := range []string{"/mnt/data", "/data", "/home/user/work", "/procfs", "/devices", "/.spacey", "/mnt/vol-1.2_x"} {
		if err := ValidatePath(p); err != nil {
			t.Errorf("ValidatePath(%q) = %v, want ok", p, err)
		}
	}
}

func TestValidatePathsOverlap(t *testing.T) {
	for _, ps := range [][]string{
		{"/mnt/a", "/mnt/a"}, {"/mnt/a", "/mnt/a/b"}, {"/mnt/a/b", "/mnt/a"},
		{"/a", "/b", "/c", "/d", "/e", "/f", "/g", "/h", "/i"},
	} {
		if err := ValidatePaths(ps); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("ValidatePaths(%q) = %v, want invalid", ps, err)
		}
	}
	if err := ValidatePaths([]string{"/mnt/a", "/mnt/ab", "/data"}); err != nil {
		t.Fatal(err)
	}
}

func TestValidateNameAndID(t *testing.T) {
	for _, n := range []string{"", "-x", ".x", "a/b", "a b", "a\x00", strings.Repeat("a", MaxNameLen+1)} {
		if err := ValidateName(n); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("ValidateName(%q) = %v", n, err)
		}
	}
	if err := ValidateName("my-vol_1.0"); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"", "vol_", "vol_../../etc/passwd0000", "VOL_0123456789abcdef01234567", "vol_0123456789abcdef0123456g", "vol_0123456789abcdef01234567/x"} {
		if err := ValidateID(id); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("ValidateID(%q) = %v", id, err)
		}
	}
	if id := NewID(); ValidateID(id) != nil {
		t.Fatalf("NewID %q does not validate", id)
	}
}

func FuzzValidatePath(f *testing.F) {
	for _, s := range []string{"/mnt/data", "/proc/x", "/a/../b", "//", "/dev"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		if ValidatePath(p) != nil {
			return
		}
		// What passes is absolute, clean, not the root and outside the
		// reserved trees, whatever the input.
		if p[0] != '/' || p == "/" || strings.Contains(p, "/../") || strings.HasSuffix(p, "/..") || strings.Contains(p, "//") {
			t.Fatalf("accepted %q", p)
		}
		for _, r := range reserved {
			if p == r || strings.HasPrefix(p, r+"/") {
				t.Fatalf("accepted reserved %q", p)
			}
		}
	})
}
