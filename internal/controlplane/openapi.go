package controlplane

import (
	"fmt"
	"net/http"
	"sync"

	"sigs.k8s.io/yaml"

	"github.com/spacesbx/space/api/openapi"
)

// The OpenAPI document, served unauthenticated: it describes the API, it
// holds nothing of any team.

// openAPIJSON converts the embedded YAML once.
var openAPIJSON = sync.OnceValues(func() ([]byte, error) {
	b, err := yaml.YAMLToJSON(openapi.YAML)
	if err != nil {
		return nil, fmt.Errorf("openapi document: %w", err)
	}
	return b, nil
})

func (s *Server) handleOpenAPIYAML(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/yaml")
	w.Header().Set("Cache-Control", "public, max-age=300")
	_, _ = w.Write(openapi.YAML)
}

func (s *Server) handleOpenAPIJSON(w http.ResponseWriter, r *http.Request) {
	b, err := openAPIJSON()
	if err != nil {
		s.writeError(w, r, err) // unclassified: a 500
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "public, max-age=300")
	_, _ = w.Write(b)
}
