package deploycheck

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Every deploy/ path the operator docs name exists, and the README links
// the walkthrough.
func TestDocsNameRealFiles(t *testing.T) {
	re := regexp.MustCompile("`(deploy/[^` ]+)`")
	for _, doc := range []string{"docs/DEPLOY.md", "docs/CONFIGURATION.md", "README.md"} {
		for _, m := range re.FindAllStringSubmatch(readFile(t, doc), -1) {
			p := strings.TrimSuffix(m[1], "/")
			for _, part := range strings.Split(p, ", ") {
				if strings.ContainsAny(part, "*") {
					if matches, _ := filepath.Glob(filepath.Join(root, part)); len(matches) == 0 {
						t.Errorf("%s names %s: nothing matches", doc, part)
					}
					continue
				}
				if _, err := os.Stat(filepath.Join(root, part)); err != nil {
					t.Errorf("%s names %s: %v", doc, part, err)
				}
			}
		}
	}
	if !strings.Contains(readFile(t, "README.md"), "(docs/DEPLOY.md)") {
		t.Error("README.md does not link docs/DEPLOY.md")
	}
}
