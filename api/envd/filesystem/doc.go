// Package filesystempb holds the generated protobuf types of envd's filesystem API
// (filesystem.proto, from E2B's envd), which spaced-guest serves and the SDKs
// call over Connect.
package filesystempb
