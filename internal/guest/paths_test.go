package guest

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
)

func TestResolvePath(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"", "/home/u"},
		{"~", "/home/u"},
		{"~/a/../b", "/home/u/b"},
		{"a/b", "/home/u/a/b"},
		{"../../../etc", "/etc"},
		{"/x//y/./z/", "/x/y/z"},
	} {
		got, err := ResolvePath(c.in, "/home/u")
		if err != nil || got != c.want {
			t.Errorf("ResolvePath(%q) = %q, %v; want %q", c.in, got, err, c.want)
		}
	}
	for _, in := range []string{"a\x00b", "~other/x"} {
		if _, err := ResolvePath(in, "/home/u"); !errors.Is(err, ErrInvalidPath) {
			t.Errorf("ResolvePath(%q) err %v", in, err)
		}
	}
	if got, _ := ResolvePath("x", "relative-home"); got != "/x" {
		t.Errorf("relative home: %q", got)
	}
}

func FuzzResolvePath(f *testing.F) {
	for _, s := range []string{"", "~", "~/a", "~x", "a/../../b", "/a\x00", "..", "//", "~/../.."} {
		f.Add(s, "/home/user")
	}
	f.Add("x", "")
	f.Fuzz(func(t *testing.T, p, home string) {
		got, err := ResolvePath(p, home)
		if err != nil {
			if !errors.Is(err, ErrInvalidPath) {
				t.Fatalf("untyped error %v", err)
			}
			return
		}
		if strings.IndexByte(p, 0) >= 0 {
			t.Fatalf("NUL accepted: %q", p)
		}
		if !filepath.IsAbs(got) || filepath.Clean(got) != got {
			t.Fatalf("ResolvePath(%q, %q) = %q: not absolute and clean", p, home, got)
		}
	})
}

func TestConfigValidate(t *testing.T) {
	good := Config{Identity: Identity{Sandbox: "s", Execution: "e", Worker: "w", Substrate: "ns", Activation: "a"}}
	if err := good.Validate(); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]Config{
		"no identity": {},
		"bad env":     {Identity: good.Identity, Env: map[string]string{"A=B": "x"}},
		"bad user":    {Identity: good.Identity, DefaultUser: "a:b"},
		"negative":    {Identity: good.Identity, MaxUploadBytes: -1},
	} {
		if err := c.Validate(); err == nil {
			t.Errorf("%s: accepted", name)
		}
		if _, err := New(c); err == nil {
			t.Errorf("%s: New accepted", name)
		}
	}
}

func TestParseStatState(t *testing.T) {
	st, pp, ok := parseStatState([]byte("42 (a) b) c) Z 1 42 42 0"))
	if !ok || st != 'Z' || pp != 1 {
		t.Fatalf("%c %d %v", st, pp, ok)
	}
	for _, bad := range []string{"", "1 (x)", "1 (x) ZZ 1", "1 (x) Z y"} {
		if _, _, ok := parseStatState([]byte(bad)); ok {
			t.Errorf("accepted %q", bad)
		}
	}
}
