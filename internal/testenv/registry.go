package testenv

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/crypto/bcrypt"
)

// RegistryBin is Debian's docker-registry (make registry-deps installs it).
const RegistryBin = "/usr/bin/docker-registry"

// Registry is a docker-registry (the CNCF distribution registry) serving
// a temp dir on loopback until its test ends.
type Registry struct {
	Host    string // 127.0.0.1:port
	Storage string // its filesystem driver's root
}

// StartRegistry runs docker-registry on a free loopback port, with
// htpasswd auth when user is set. It skips t (through Skipf) without the
// binary.
func StartRegistry(t testing.TB, user, password string) *Registry {
	t.Helper()
	if _, err := os.Stat(RegistryBin); err != nil {
		Skipf(t, "%s missing (make registry-deps installs Debian's docker-registry): %v", RegistryBin, err)
	}
	// The free port is free only until something else takes it: a
	// registry that exits at once gets another port.
	for attempt := 1; ; attempt++ {
		reg, out, err := tryStartRegistry(t, user, password)
		if err == nil {
			return reg
		}
		if attempt == 3 {
			t.Fatalf("docker-registry: %v\n%s", err, out)
		}
	}
}

func tryStartRegistry(t testing.TB, user, password string) (*Registry, string, error) {
	t.Helper()
	dir := t.TempDir()
	storage := filepath.Join(dir, "storage")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	host := l.Addr().String()
	l.Close()
	cfg := fmt.Sprintf("version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: %s\n",
		storage, host)
	if user != "" {
		hash, err := bcrypt.GenerateFromPassword([]byte(password), bcrypt.MinCost)
		if err != nil {
			t.Fatal(err)
		}
		htp := filepath.Join(dir, "htpasswd")
		if err := os.WriteFile(htp, []byte(user+":"+string(hash)+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		cfg += fmt.Sprintf("auth:\n  htpasswd:\n    realm: space-test\n    path: %s\n", htp)
	}
	cfgPath := filepath.Join(dir, "config.yml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	logPath := filepath.Join(dir, "registry.log")
	out, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(RegistryBin, "serve", cfgPath)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
		out.Close()
	})
	logText := func() string { b, _ := os.ReadFile(logPath); return string(b) }
	deadline := time.Now().Add(15 * time.Second)
	probe := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: time.Second}
	for {
		resp, err := probe.Get("http://" + host + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusUnauthorized {
				return &Registry{Host: host, Storage: storage}, "", nil
			}
		}
		select {
		case err := <-exited:
			exited <- err
			return nil, logText(), errors.Join(errors.New("exited"), err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("docker-registry not ready on %s: %v\n%s", host, err, logText())
		}
		time.Sleep(30 * time.Millisecond)
	}
}
